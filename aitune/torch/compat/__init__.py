"""Adapters that let code written against the reference system's extension contracts run on aitune's.

:mod:`.strategy` runs a strategy that overrides ``_tune(module, name, graph_spec, data, device, cache_dir)``;
:mod:`aitune.torch.backend.reference_contract` adapts backends written with ``to_dict``/``from_dict``/
``is_jit``/``_deploy``; :mod:`aitune.torch.common.legacy_names` resolves names the reference's examples still use.
"""
