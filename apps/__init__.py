"""Applications on top of the layers: the demo (:mod:`.demo`, on the embedded deployment of
:mod:`netagg.bmv2.deployment`), the ``torch.distributed`` backend (:mod:`.torch_backend`; users import it
as ``netagg.torch_backend``) and the kernel warm-up (:mod:`.warmup`). Nothing below this package imports it."""
