#!/bin/sh
# Copies the embedded Apache Kafka broker's jars and their run-time dependencies from Maven
# Central into deploy/kafka/lib. Idempotent and fast when lib/ already holds the jars of the
# current pom.xml, so `make test` can call it every time.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
stamp="$here/lib/.pom.sha256"
wanted=$(sha256sum "$here/pom.xml" | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$wanted" ]; then
    exit 0
fi
if ! command -v mvn >/dev/null 2>&1; then
    echo "fetching the Apache Kafka jars needs Maven: apt-get install maven" >&2
    exit 1
fi
rm -rf "$here/lib.partial"
mvn -q -B -Dstyle.color=never -f "$here/pom.xml" dependency:copy-dependencies \
    -DincludeScope=runtime -DoutputDirectory="$here/lib.partial"
echo "$wanted" > "$here/lib.partial/.pom.sha256"
rm -rf "$here/lib"
mv "$here/lib.partial" "$here/lib"
