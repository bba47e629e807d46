"""Entry point: ``uvicorn server:app`` serves $LOOPSERVE_CONFIG, else the demo set."""

from pipeline.app import create_app
from pipeline.settings import load_settings

app = create_app(load_settings())
