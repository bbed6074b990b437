"""Reference models written as DeepSpeed LayerSpecs."""
