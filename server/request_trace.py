"""A per-request timeline for latency work (`openinfer serve --request-trace FILE`): one JSON line per HTTP
generation request, its moments on the system-wide monotonic clock (time.monotonic, the clock of the engine's
step trace `tm` too, so the two files line up across the server and engine processes):

    http         the handler starts (the body has arrived)
    parsed       the request is parsed and its prompts tokenized (handed to the engine right after)
    scheduled    the engine's Scheduled event reaches the server (the first prompt's)
    first_token  the first generated token reaches the server
    first_sent   the response chunk carrying it is written (streaming requests)
    end          the request's last event

bench/request_trace.py tabulates the gaps (and, given the step trace, the first token's step inside them)."""
from __future__ import annotations

import json

MOMENTS = ("http", "parsed", "scheduled", "first_token", "first_sent", "end")


class RequestTrace:
    def __init__(self, path: str):
        self.file = open(path, "a", encoding="utf-8", buffering=1)

    def write(self, request_id: str, moments: dict[str, float | None], **counts) -> None:
        row = {"id": request_id, **{k: None if moments.get(k) is None else round(moments[k], 6) for k in MOMENTS},
               **counts}
        self.file.write(json.dumps(row) + "\n")

    def close(self) -> None:
        self.file.close()
