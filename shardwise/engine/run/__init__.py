"""The one executor that runs any Plan, and what it needs at run time: per-rank random streams,
the step's metrics, cross-rank agreement checks.

May import every folder before it except ``simulate``.
"""
