"""Static shapes for graph-compiled devices (Gaudi): every step padded to one of a fixed set of shapes.

- `buckets`: the bucket schemes (tgi-gaudi's knobs), `StepShape`, and every shape serving can meet;
- `padding`: a step padded to its shape without changing any real row, the log of the shapes
  compiled, and the warmup that compiles every shape before serving;
- `graphs`: a padded step as a module of tensors, graph-wrapped per shape (HPU graphs).
"""
