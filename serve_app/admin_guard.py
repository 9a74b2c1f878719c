"""Who may call the /admin routes (serve_app/ingress.py asks before each one).

- off unless `admin.enabled` (404);
- with a token (`admin.token`, or the variable `admin.token_env` names, read where the
  ingress runs), every call needs `Authorization: Bearer <token>` (401), compared in
  constant time so that how long a wrong guess takes says nothing about the token;
- enabled without a token only when Serve listens on a loopback host: otherwise the ingress
  refuses to start, naming `admin.token`.
"""

from __future__ import annotations

import hmac

from fastapi import Request, status

from serve_app.config import AdminConfig
from serve_app.ray_llm import OpenAIHTTPException


class AdminGuard:
    def __init__(self, admin: AdminConfig, http_host: str):
        """`http_host`: the host Serve's HTTP proxy listens on. ValueError, naming the field,
        for a token variable that is unset or for open routes on a public host."""
        self.enabled = admin.enabled
        self._expected: bytes | None = None
        if admin.enabled:
            admin.check_exposure(http_host)
            token = admin.resolve_token()
            self._expected = f"Bearer {token}".encode() if token else None

    def check(self, request: Request) -> None:
        """Raise the OpenAI-style 404 or 401 unless this request may call an admin route."""
        if not self.enabled:
            raise OpenAIHTTPException(
                status_code=status.HTTP_404_NOT_FOUND, type="NotFound",
                message="admin routes are disabled; set admin.enabled: true in the app config")
        given = request.headers.get("authorization", "").encode()
        if self._expected is not None and not hmac.compare_digest(given, self._expected):
            raise OpenAIHTTPException(
                status_code=status.HTTP_401_UNAUTHORIZED, type="Unauthorized",
                message="admin routes need the header `Authorization: Bearer <admin token>`")
