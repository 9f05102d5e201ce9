"""The HTTP frontend and the `deepserve` command line.

FastAPI app, protocol conversion through deepseek-recipe, model families (prompt rendering, stop
tokens, output parsing), Prometheus metrics. Knows protocols, not model math.
"""
