"""The upper floor: reads what the measuring tools of evals/ wrote (per-example results,
divergence tables, influence profiles, training curves) and publishes it: statistics, tables,
figures, reports and findings. It may import evals/ and ced/; nothing below imports it
(tests/unit/test_layering.py). `analysis.publish` is its bottom: the helpers every publisher
shares."""
