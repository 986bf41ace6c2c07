"""Callbacks for the trainers people already run (optional extras, imported by nobody in the core).

* :mod:`fslr_func.integrations.transformers`: Hugging Face ``Trainer`` (``pip install
  fslr_func[hf]``);
* :mod:`fslr_func.integrations.lightning`: PyTorch Lightning (``pip install
  fslr_func[lightning]``).

Both offer ``FSLRCallback(probe_dataset, ...)`` (record a base run into ``fslr_record.json``)
and ``FLeRMCallback(base, probe_dataset, ...)`` (drive a scaled run from that record), built on
:class:`~fslr_func.integrations.session.Session`.
"""
