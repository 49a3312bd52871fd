"""vlmprune.passes: onnx_ir passes that insert, retarget and fuse visual-token pruning."""
