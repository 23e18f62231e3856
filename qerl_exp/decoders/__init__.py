"""The model computed by hand, and scoring: a decoder read into blocks (`blocks`), the padding-free
pass over packed rows (`padding_free`, `packing`, its Triton kernels in `elementwise`), the one
teacher-forced scorer (`scoring`) and the rollout batch they read (`batch`).

Reads config/ and quant/; the CUDA engine (engine/) and the learner (rl/) read it.
"""
