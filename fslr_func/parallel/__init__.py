"""Layer 3, probes that span processes: the data-parallel reduction (omega slices, all-reduced
probe gradients), process-group helpers and FSDP2 gathering. The public face of this layer is
:mod:`fslr_func.distributed`.
"""
