"""The RL algorithm: sampling completions (`rollout`), advantages and the policy loss (`loss`), the
policy update (`learner`), the optimizer and its schedule (`optim`), AQN noise (`noise`) and every
logged metric (`metrics`).

Reads every floor below it (config/, run/, quant/, tasks/, decoders/, engine/, models/); evaluation
and the commands read it.
"""
