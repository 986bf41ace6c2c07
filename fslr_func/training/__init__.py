"""Layer 4, training control: the wrapper that measures an optimiser step (``with_fslr``),
the Recorder of a base run, FLeRM (a pure rule and the thin adapter that applies it to any
optimiser by scaling updates) and the depth-mapping policies.
"""
