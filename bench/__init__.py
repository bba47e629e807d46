"""The loopserve benchmark: ``python -m bench`` (``make bench``).

Measures the HTTP ceiling (a bare app), the model ceiling (raw ONNX Runtime),
and the server in batched and unbatched modes, with wrk on 127.0.0.1 only.
Every load is bounded in time; a missed target is reported, never fatal.
"""
