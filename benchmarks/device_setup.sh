# Source this on the lent GPU machine (the image has torch 2.11 + triton, no deepmd-kit), from the repo root.
#
# Here, once per session (python 3.12 wheels for the image; ignored by git through .git/info/exclude):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d .whl \
#     deepmd-kit==3.2.0 array-api-compat bracex colorama dargs==0.5.1 Deprecated einops flexcache flexparser h5py \
#     lmdb mendeleev ml_dtypes mpich msgpack Pint pyfiglet SQLAlchemy wcmatch wrapt typeguard pydantic \
#     pydantic_core annotated-types typing-inspection platformdirs typing_extensions pytest pluggy iniconfig \
#     vesin==0.6.2 vesin-torch==0.6.2
#   (vesin + vesin-torch: DPA-4's neighbour lists, `import vesin.torch`; the image has no nvalchemiops, which deepmd
#   would prefer on CUDA, so DPA-4 runs with vesin there too. 3.4 MB.)
#   rm -f .whl/deepmd_hybridmuon-*.whl && pip wheel --no-deps -w .whl .     # after every code change
# Then run with carry [".whl"] (the water inputs travel with the tree, in examples/water) and a command
# starting `source benchmarks/device_setup.sh && ...`.
set -e
python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl 2>&1 | tail -2
# a warm machine keeps the previous install of the same version: replace ours explicitly
python3 -m pip install -q --no-index --no-deps --no-compile --force-reinstall .whl/deepmd_hybridmuon-*.whl
python3 -c "import torch, deepmd, deepmd_hybridmuon, vesin.torch; print('torch', torch.__version__, 'gpu', torch.cuda.get_device_name())"
set +e
