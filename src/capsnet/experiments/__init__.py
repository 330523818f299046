"""The paper's experiments beyond plain classification: MultiMNIST (§6), expanded MNIST -> affNIST (§5.2), and
`reproduce`, which runs each against the paper's figures; and `compare` (with `measure`, one entry's run), which
trains routings and models alike and measures them.

May import: capsnet.training and everything below it; never viz or cli.
"""
