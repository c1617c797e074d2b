"""The backend: which implementation computes each op, and the weights in the formats the
kernels read (llama.cpp's ggml backends and their buffer types).

- ops.py: `Backend`, chosen once at model load for a device and a weights mode; the ops the
  models call by name (`ops.attend`, `ops.rms_norm_ggml`, `ops.decoder`, the scans).
- linear.py: linear layers and token embeddings over GGUF weights, held as the weights mode and
  the backend ask (the compiled block matmul's bytes, int4pack's planes, dense float32/f16/bf16);
  the tensor types kvtool reads.
- device_file.py: a GGUFFile whose tensors are dequantized on the device.
- decoder.py: the bridge to the compiled decoder call.

The model modules (kvtool/models) import no kernel module: compute reaches the kernels through
here. This package's own __init__ imports nothing, so a model module can import linear.py
without importing `Backend`, which imports the models' building blocks (no import cycle).
"""
