"""grouprl inside the trainers people already scale with: TRL and verl.

- :mod:`grouprl.integrations.verl`: importing it registers every grouprl estimator in verl's
  advantage-estimator registry as ``grouprl_<name>`` and every grouprl surrogate in its
  policy-loss registry (``VERL_USE_EXTERNAL_MODULES=grouprl.integrations.verl``).
- :mod:`grouprl.integrations.trl`: ``GroupRLGRPOTrainer``, a ``trl.GRPOTrainer`` whose
  advantages (and, where a preset needs it, loss) are grouprl's, and
  ``GroupRLDiagnosticsCallback``.

Neither submodule is imported here: TRL and verl are optional (``scripts/install-peers.sh``).
"""

__all__ = ["trl", "verl"]
