"""Step: the immutable value train_step returns and the transforms rewrite; its planning.

The top of the engine: may import every folder.
"""
