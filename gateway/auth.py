"""Bearer-token auth: tokens are held only as sha256 hashes, scopes per run or global.

`write` includes `read`. A token limited to runs may not upload or read datasets: those
are shared by every run, so they need a global token.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.config import GatewayConfig, Scope, TokenSpec, hash_token


@dataclass(frozen=True)
class Principal:
    """Who is calling (the token's name, never the token) and what it may do."""

    name: str
    scopes: frozenset[str]
    runs: frozenset[str] | None  # None: every run

    def allows(self, scope: Scope, run_id: str | None = None) -> bool:
        if scope not in self.scopes and not (scope == "read" and "write" in self.scopes):
            return False
        if self.runs is None:
            return True
        return run_id is not None and run_id in self.runs


ANONYMOUS = Principal("anonymous", frozenset({"read", "write"}), None)


def _principal(spec: TokenSpec) -> Principal:
    return Principal(spec.name, frozenset(spec.scopes),
                     None if spec.is_global else frozenset(spec.runs or ()))


class TokenStore:
    """Looks tokens up by hash, so the plaintext is never compared or kept."""

    def __init__(self, config: GatewayConfig):
        self._by_hash = {spec.sha256: _principal(spec) for spec in config.tokens}
        self.allow_anonymous = config.allow_anonymous

    def authenticate(self, token: str | None) -> Principal | None:
        """The token's principal; anonymous without a token when allowed; else None."""
        if token is None:
            return ANONYMOUS if self.allow_anonymous else None
        return self._by_hash.get(hash_token(token))
