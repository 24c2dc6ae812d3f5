"""ONNX graphs: the one builder (builder.GraphBuilder, OPSET, serialize) below the packs, the text encoder and the VAE."""
