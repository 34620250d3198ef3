"""DSpark for Kimi K3: remote-code package (configuration, model, generation, kernels)."""
