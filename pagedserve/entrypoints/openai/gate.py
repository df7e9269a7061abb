"""The gate every HTTP request passes before a route: request id, API key -> tenant, admin scope, body size, the
tenant's request and concurrency limits; and, on the way out, the response headers of all of these, the HTTP
metrics and the request's access-log line.

It is pure ASGI middleware, never buffering a body (streams go through as they are made): headers are added to
the `http.response.start` message. A refused request gets its error here and reaches neither a route nor the
engine.
"""

from __future__ import annotations

from typing import Optional

from fastapi.responses import JSONResponse

from pagedserve.entrypoints.openai.errors import error_response
from pagedserve.entrypoints.openai.rate_limits import RATE_LIMITED_ROUTES, ratelimit_headers, refusal_error
from pagedserve.entrypoints.openai.request_context import (REQUEST_ID_HEADER, REQUEST_ID_PATTERN, SCOPE_KEY,
                                                           RequestContext, new_request_id)
from pagedserve.logging_utils.request_log import RequestLog, RequestLogConfig, RequestRecord
from pagedserve.metrics.prometheus import PrometheusStatLogger
from pagedserve.tenants.rate_limiter import RateLimiter
from pagedserve.tenants.registry import ANONYMOUS, TenantStore
from pagedserve.tenants.tenant import Tenant

ROUTES = ("/health", "/version", "/metrics", "/tokenize", "/detokenize", "/v1/models", "/v1/completions",
          "/v1/chat/completions", "/reset_prefix_cache", "/v1/load_lora_adapter", "/v1/unload_lora_adapter",
          "/debug/inject_fault", "/openapi.json")
"""Routes counted under their own name in http_requests_total (anything else is "other")."""
OPEN_ROUTES = ("/health",)
"""Routes that never need a key."""
ADMIN_ROUTES = ("/reset_prefix_cache", "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/debug/inject_fault")
"""Routes for admin-scope keys only (403 for a user key). Every admin route joins this list."""
REPLICA_HEADER = b"x-pagedserve-replica"
"""Names the engine replica(s) that served a generation request (Ray scale-out only)."""


class Gate:
    def __init__(self, app, max_body_bytes: int, metrics: PrometheusStatLogger, tenants: TenantStore,
                 rate_limiter: RateLimiter, request_log: Optional[RequestLog] = None) -> None:
        self.app, self.max_body_bytes, self.metrics = app, max_body_bytes, metrics
        self.tenants, self.rate_limiter = tenants, rate_limiter
        self.request_log = request_log or RequestLog(RequestLogConfig(enabled=False))

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        given_id = headers.get(REQUEST_ID_HEADER.lower().encode())
        request_id = new_request_id() if given_id is None else given_id.decode("latin-1")
        valid_id = REQUEST_ID_PATTERN.fullmatch(request_id) is not None
        status, ctx, record = [500], None, RequestRecord()  # routes fill in the record via ctx

        async def send_with_headers(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                extra = self._response_headers(request_id if valid_id else None, ctx)
                message = {**message, "headers": [*message.get("headers", ()), *extra]}
            await send(message)

        try:
            ctx, refused = self._admit(scope, headers, request_id, valid_id, record)
            if refused is not None:
                return await refused(scope, receive, send_with_headers)
            scope[SCOPE_KEY] = ctx
            await self.app(scope, receive, send_with_headers)
        finally:
            self._count(scope, ctx, status[0])
            if ctx is not None:
                ctx.close()
            self.request_log.write(request_id if valid_id else "invalid", ctx.tenant.name if ctx else None,
                                   scope.get("method", ""), scope["path"], status[0], record,
                                   ctx.replicas if ctx else [])

    def _admit(self, scope, headers: dict, request_id: str, valid_id: bool,
               record: RequestRecord) -> tuple[Optional[RequestContext], Optional[JSONResponse]]:
        """The request's context, and the error response when it may not pass (None: it may)."""
        path = scope["path"]
        tenant = self._tenant(headers, path)
        if tenant is None:
            return None, error_response("Invalid or missing API key: send `Authorization: Bearer <key>`.", 401,
                                        code="invalid_api_key")
        ctx = RequestContext(request_id, tenant, record=record)
        if path not in OPEN_ROUTES:
            ctx.limiter = self.rate_limiter.for_tenant(tenant.name, tenant.limits)
            ctx.metrics = self.metrics.tenants
        if not valid_id:
            return ctx, error_response(f"{REQUEST_ID_HEADER} must be 1 to 128 of the characters A-Z a-z 0-9 . _ : -",
                                       400, param=REQUEST_ID_HEADER)
        if path in ADMIN_ROUTES and not tenant.is_admin:
            return ctx, error_response(f"{path} needs an admin key; tenant {tenant.name} has scope "
                                       f"{tenant.scope!r}.", 403, code="permission_denied")
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return ctx, error_response(f"The request body is over the limit of {self.max_body_bytes} bytes.", 413,
                                       code="request_too_large")
        if path in RATE_LIMITED_ROUTES and scope.get("method") == "POST":
            refusal = ctx.admit()
            if refusal is not None:
                return ctx, refusal_error(refusal, tenant.name).response()
        return ctx, None

    def _tenant(self, headers: dict, path: str) -> Optional[Tenant]:
        """The caller's tenant; None when a key is needed and the request has no valid one."""
        registry = self.tenants.registry  # one snapshot per request: a reload swaps the whole registry
        if not registry.auth_required or path in OPEN_ROUTES:
            return ANONYMOUS
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        if scheme.lower() != b"bearer":
            return None
        return registry.authenticate(token.strip())

    @staticmethod
    def _response_headers(request_id: Optional[str], ctx: Optional[RequestContext]) -> list[tuple[bytes, bytes]]:
        headers = [] if request_id is None else [(b"x-request-id", request_id.encode())]
        if ctx is not None and ctx.limiter is not None:
            headers += ratelimit_headers(ctx.limiter)
        if ctx is not None and ctx.replicas:
            headers.append((REPLICA_HEADER, ",".join(ctx.replicas).encode()))
        return headers

    def _count(self, scope, ctx: Optional[RequestContext], status: int) -> None:
        path = scope["path"]
        self.metrics.http_requests.labels(path if path in ROUTES else "other", scope.get("method", ""),
                                          str(status)).inc()
        if ctx is not None and path in RATE_LIMITED_ROUTES:
            self.metrics.tenants.count_request(ctx.tenant.name, status)
