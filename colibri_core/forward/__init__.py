"""The forward pass: the C step's tables (steptables), the one pipeline (pipeline), Model's
forward and decode step (model), and the numpy reference forward (reference)."""
