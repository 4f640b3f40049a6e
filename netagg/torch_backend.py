"""``import netagg.torch_backend`` registers the ``netagg`` torch.distributed backend: a thin re-export of
:mod:`netagg.apps.torch_backend`, where the backend lives (above the layers it uses)."""

from netagg.apps.torch_backend import *  # noqa: F403
from netagg.apps.torch_backend import __all__  # noqa: F401
