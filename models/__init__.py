"""The demo servables, one package per model: ``models.<name>`` builds its ONNX file.

Builds are seeded and offline; ``python -m models.build`` writes them all.
"""
