"""Peers compiled or timed beside the layer: MaxText's RoutedMoE, a torchtitan-style PyTorch layer."""
