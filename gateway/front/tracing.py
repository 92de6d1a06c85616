"""OpenTelemetry spans for each request, each upstream attempt and each spill; off by default.

`build_tracing` makes one `Tracing` in create_app, on a TracerProvider of its own (the
process-wide one is never set), and the pipeline holds it, or None when tracing is off:
then a request makes one check and nothing else, no span object and no context.

Per request, `Tracing.begin` opens the SERVER span (a client's `traceparent` is its
parent) and hands back a `RequestTrace` (gateway/front/trace.py). Its `spill` wraps each
overflow policy the chain tries in a span, and its `forwarder` wraps the request's
forwarder so that each upstream attempt is a CLIENT span whose `traceparent` goes to the
upstream: vLLM's own spans join the trace. Attribute names follow OpenTelemetry's GenAI
and HTTP semantic conventions; the gateway's own are under `spillgate.`.
"""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import SpanKind
from starlette.types import Scope

from gateway.config import TracingSettings
from gateway.front.trace import PROPAGATOR, PROVIDER_NAME, RequestTrace

OTLP_TRACES_PATH = "/v1/traces"
DEFAULT_OTLP_ENDPOINT = "http://localhost:4318"  # the OTLP/HTTP default, as the SDK has it
TRACE_HEADERS = (b"traceparent", b"tracestate")
# the GenAI operation each endpoint performs, by its path
OPERATIONS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "text_completion",
    "/v1/embeddings": "embeddings",
    "/v1/responses": "chat",
}


def otlp_endpoint(settings: TracingSettings, environ: Mapping[str, str]) -> str:
    """Where spans go: the config's collector, else the standard OTEL_ variables (the
    traces one as it is, the general one with /v1/traces added), else the local default."""
    if settings.otlp_endpoint is not None:
        return settings.otlp_endpoint.rstrip("/") + OTLP_TRACES_PATH
    traces = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
    if traces:
        return traces
    base = environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip() or DEFAULT_OTLP_ENDPOINT
    return base.rstrip("/") + OTLP_TRACES_PATH


def build_tracing(
    settings: TracingSettings,
    *,
    environ: Mapping[str, str],
    exporter: SpanExporter | None = None,
) -> Tracing | None:
    """The app's tracing, or None when it is off. `exporter` replaces the OTLP one (tests
    pass an in-memory exporter); spans then go to it as each ends."""
    if not settings.enabled:
        return None
    processor: SimpleSpanProcessor | BatchSpanProcessor
    if exporter is None:
        # exported in batches from the processor's own thread: never on the event loop
        processor = BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint(settings, environ)))
    else:
        processor = SimpleSpanProcessor(exporter)
    provider = TracerProvider(
        resource=Resource.create({"service.name": settings.service_name}),
        sampler=ParentBased(TraceIdRatioBased(settings.sample_ratio)),
    )
    provider.add_span_processor(processor)
    return Tracing(provider)


class Tracing:
    """The gateway's tracer; `shutdown` flushes what is still to be exported."""

    def __init__(self, provider: TracerProvider) -> None:
        self.provider = provider
        self._tracer = provider.get_tracer("spillgate")

    def begin(self, scope: Scope) -> RequestTrace:
        """The SERVER span of one request, child of the client's `traceparent` if it sent one."""
        carrier = {
            name.decode(): value.decode("latin-1")
            for name, value in scope["headers"]
            if name in TRACE_HEADERS
        }
        parent = PROPAGATOR.extract(carrier) if carrier else Context()
        path = scope["path"]
        operation = OPERATIONS.get(path, path.rsplit("/", 1)[-1])
        span = self._tracer.start_span(
            operation,
            context=parent,
            kind=SpanKind.SERVER,
            attributes={
                "gen_ai.operation.name": operation,
                "gen_ai.provider.name": PROVIDER_NAME,
                "http.request.method": scope["method"],
                "url.path": path,
            },
        )
        return RequestTrace(self._tracer, span, operation)

    def shutdown(self) -> None:
        self.provider.shutdown()
