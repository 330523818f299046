"""The paper's experiments beyond plain classification: MultiMNIST (§6), expanded MNIST -> affNIST (§5.2), and
`reproduce`, which runs each against the paper's figures.

May import: capsnet.training and everything below it; never viz or cli.
"""
