"""odtrain's graph layer: IR, ONNX import and export, op rules, autodiff and memory planning.

Imports numpy and onnx only; never `odtrain.kernels` or `odtrain` itself.
"""
