"""An in-test OTLP/HTTP trace collector and span helpers."""

from __future__ import annotations

import gzip
import threading
import time

import uvicorn
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


class OtlpReceiver:
    """A minimal OTLP/HTTP trace collector: decodes every span it is sent."""

    def __init__(self) -> None:
        self.spans: list = []

        async def traces(request: Request) -> Response:
            body = await request.body()
            if request.headers.get("content-encoding") == "gzip":
                body = gzip.decompress(body)
            export = ExportTraceServiceRequest.FromString(body)
            for rs in export.resource_spans:
                for ss in rs.scope_spans:
                    self.spans.extend(ss.spans)
            return Response(b"", media_type="application/x-protobuf")

        app = Starlette(routes=[Route("/v1/traces", traces, methods=["POST"])])
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"

    def wait_for(self, predicate, timeout=20.0):
        deadline = time.monotonic() + timeout
        while not predicate(self.spans):
            assert time.monotonic() < deadline, f"spans never arrived ({len(self.spans)} so far)"
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def attrs(span) -> dict:
    out = {}
    for kv in span.attributes:
        v = kv.value
        out[kv.key] = (
            next(getattr(v, f) for f in ("string_value", "int_value", "double_value", "bool_value") if v.HasField(f))
            if not v.HasField("array_value")
            else [x.string_value for x in v.array_value.values]
        )
    return out
