"""Lightning strategies for the 1-bit optimizers: real 2-rank gloo runs of the main job's model."""
