"""The classifier's ONNX graph: a small ResNet, image [batch, 3, 224, 224] -> logits [batch, 1000].

Stem (conv 3x3/2, BN, ReLU, max-pool 3x3/2), one basic residual block per stage at
widths 32, 64, 128, 256, then global average pooling and a linear head. Weights
are seeded He-init, not trained; BN statistics sit near identity so activations
stay finite. About 0.2 GMAC per image.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from models.onnxbuild import GraphBuilder, float_tensor, normal, save

SEED = 224
IMAGE_PX = 224
STEM_WIDTH = 32
STAGE_WIDTHS = (32, 64, 128, 256)
CLASSES = 1000
BN_EPSILON = 1e-5


class _ResNet:
    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self.g = GraphBuilder()

    def conv_bn(self, x: str, c_in: int, c_out: int, kernel: int, stride: int) -> str:
        fan_in = c_in * kernel * kernel
        w = self.g.weight(
            "conv_w", normal(self.rng, (c_out, c_in, kernel, kernel), (2 / fan_in) ** 0.5)
        )
        pad = kernel // 2
        y = self.g.op(
            "Conv", x, w, kernel_shape=[kernel, kernel], strides=[stride, stride], pads=[pad] * 4
        )
        return self.batch_norm(y, c_out)

    def batch_norm(self, x: str, channels: int) -> str:
        # Plausible running statistics: close to identity, with a little seeded noise.
        shape = (channels,)
        gamma = self.g.weight("bn_gamma", 1 + normal(self.rng, shape, 0.05))
        beta = self.g.weight("bn_beta", normal(self.rng, shape, 0.05))
        mean = self.g.weight("bn_mean", normal(self.rng, shape, 0.05))
        var = 1 + np.abs(normal(self.rng, shape, 0.05))
        variance = self.g.weight("bn_var", var)
        return self.g.op("BatchNormalization", x, gamma, beta, mean, variance, epsilon=BN_EPSILON)

    def basic_block(self, x: str, c_in: int, c_out: int, stride: int) -> str:
        y = self.g.op("Relu", self.conv_bn(x, c_in, c_out, 3, stride))
        y = self.conv_bn(y, c_out, c_out, 3, 1)
        # A 1x1 projection on the skip path only where the shape changes.
        skip = x if stride == 1 and c_in == c_out else self.conv_bn(x, c_in, c_out, 1, stride)
        return self.g.op("Relu", self.g.op("Add", y, skip))

    def graph(self) -> str:
        x = self.g.op("Relu", self.conv_bn("image", 3, STEM_WIDTH, 3, 2))
        x = self.g.op("MaxPool", x, kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
        c_in = STEM_WIDTH
        for i, width in enumerate(STAGE_WIDTHS):
            x = self.basic_block(x, c_in, width, stride=1 if i == 0 else 2)
            c_in = width
        x = self.g.op("Flatten", self.g.op("GlobalAveragePool", x), axis=1)
        w = self.g.weight("fc_w", normal(self.rng, (c_in, CLASSES), c_in**-0.5))
        b = self.g.weight("fc_b", np.zeros(CLASSES, np.float32))
        return self.g.op("Gemm", x, w, b, output="logits")


def build(path: Path) -> None:
    net = _ResNet(np.random.default_rng(SEED))
    net.graph()
    model = net.g.model(
        "classifier",
        [float_tensor("image", ["batch", 3, IMAGE_PX, IMAGE_PX])],
        [float_tensor("logits", ["batch", CLASSES])],
    )
    save(model, path)
