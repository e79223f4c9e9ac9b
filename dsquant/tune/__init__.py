"""`dsquant tune`: choose a recipe from measured accuracy and measured latency (issue 25).

space.py (groups x schemes), sensitivity.py (per-candidate KL), latency.py (kernel times, fixed
work, cache), search.py (exact multiple-choice knapsack and the front), proof.py (quantize and
validate the choice), report.py (recipe.yaml, tune.json, tune.md, pareto.png), runner.py (the flow).
"""
