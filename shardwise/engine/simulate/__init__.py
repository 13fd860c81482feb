"""simulate(plan): a Plan priced by costs (measured or modelled) and laid out as a timeline.

Reads Plans only: may import ``plan`` and the folders before it, never ``run`` or ``step``.
"""
