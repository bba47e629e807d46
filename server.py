"""Entry point: ``uvicorn server:app`` serves $LOOPSERVE_CONFIG, else the demo set."""

import logging

from pipeline.app import create_app
from pipeline.settings import load_settings

# uvicorn configures only its own loggers; ours (which providers each model really
# runs on, fallbacks, failures) go to the same stream in the same shape.
logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(name)s: %(message)s")

app = create_app(load_settings())
