"""The HTTP ceiling: a bare Starlette app doing only what every request costs.

It parses the same JSON body as the server (orjson, then ``np.asarray`` to
float32) and answers a constant small JSON, so the gap between this and the
server is the price of batching, inference and serialising the outputs.
Served as ``uvicorn bench.bare:app`` with the server's flags.
"""

from __future__ import annotations

import numpy as np
import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

_ANSWER = orjson.dumps({"outputs": {"y": [0.0]}})


async def predict(request: Request) -> Response:
    payload = orjson.loads(await request.body())
    for value in payload["inputs"].values():
        # The server's parsing cost, paid in full; the constant answer does not depend on it.
        np.asarray(value, dtype=np.float32)
    return Response(_ANSWER, media_type="application/json")


async def ready(request: Request) -> Response:
    return PlainTextResponse("ready")


app = Starlette(
    routes=[
        Route("/predict/{model}", predict, methods=["POST"]),
        Route("/ready", ready, methods=["GET"]),
    ]
)
