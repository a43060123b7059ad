#!/bin/sh
# System packages the test suite needs beyond the Python ones: Debian's chromium and
# chromium-driver for the dashboard browser test, a Java 17 runtime for the Spark tests.
# Idempotent: does nothing when all are already installed, so `make test` can call it
# every time.
set -eu
if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1 \
        && command -v java >/dev/null 2>&1; then
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
    chromium chromium-driver openjdk-17-jre-headless
