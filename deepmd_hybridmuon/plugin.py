"""placeholder"""


def on_deepmd_backend():
    pass


def on_deepmd_pt():
    pass


def on_deepmd_pt_expt():
    pass
