"""The example workloads as Keras models (TensorFlow backend)."""

from __future__ import annotations

from typing import Any

from .weights import CNN_FILTERS, CNN_KERNEL, CNN_OUTPUTS, CNN_STRIDE, cnn_weights, mlp_weights


def mlp(sizes: tuple[int, ...], seed: int = 0, dtype: str = "float32") -> Any:
    import keras

    layers = mlp_weights(sizes, seed)
    inp = keras.Input((sizes[0],), dtype=dtype)
    h = inp
    dense = []
    for i, (w, _) in enumerate(layers):
        act = "tanh" if i < len(layers) - 1 else None
        layer = keras.layers.Dense(w.shape[1], activation=act, dtype=dtype)
        h = layer(h)
        dense.append(layer)
    model = keras.Model(inp, h, name=f"mlp_{'_'.join(map(str, sizes))}")
    for layer, (w, b) in zip(dense, layers):
        layer.set_weights([w.astype(dtype), b.astype(dtype)])
    return model


def cnn(seed: int = 0, dtype: str = "float32") -> Any:
    import keras

    wts = cnn_weights(seed)
    inp = keras.Input((28, 28, 1), dtype=dtype)
    h = inp
    convs = []
    for c_out in CNN_FILTERS:
        conv = keras.layers.Conv2D(c_out, CNN_KERNEL, strides=CNN_STRIDE, padding="valid",
                                   activation="tanh", dtype=dtype)
        h = conv(h)
        convs.append(conv)
    h = keras.layers.Flatten(dtype=dtype)(h)
    dense = keras.layers.Dense(CNN_OUTPUTS, dtype=dtype)
    out = dense(h)
    model = keras.Model(inp, out, name="cnn")
    for i, conv in enumerate(convs):
        conv.set_weights([wts[f"conv{i}_w"].astype(dtype), wts[f"conv{i}_b"].astype(dtype)])
    dense.set_weights([wts["dense_w"].astype(dtype), wts["dense_b"].astype(dtype)])
    return model


