"""Whole models as chains: capture (torch.export), segmentation into stages, stage graphs."""
