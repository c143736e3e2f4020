"""Benchmarks of the windowkit operators (``windowkit bench ...``). Not imported by the library itself.

    from windowkit.benchmarks import kv
    result = kv.run(quick=True, json_path="bench/results/kv_quick.json")
"""
