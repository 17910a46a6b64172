"""course_lib: the importable half of the course "Parallel training in PyTorch from scratch".

The package mirrors PyTorch, so that a learner who opens torch's source afterwards finds each idea
in the same place: ``course_lib.parallel`` is ``torch.nn.parallel`` (one process, several
devices), ``course_lib.distributed`` is ``torch.distributed`` (several processes),
``course_lib.models`` plays ``torchvision.models``.

Lesson -> module:

====  =====================================  =================================================
00    setup and devices                      ``devices``, ``timing`` (``Timer``), ``plots``
01    functional LeNet on one device         ``models.lenet``, ``data``, ``train``
02    replicate and allreduce                ``parallel.comm``
03    scatter and split_batch                ``parallel.comm``
04    training on several devices            ``train`` (``train_batch``, ``train``),
                                             ``parallel.parallel_apply``
05    nn.DataParallel                        ``models.resnet``, ``parallel.replicate``,
                                             ``parallel.scatter_gather``,
                                             ``parallel.data_parallel``, ``bench.breakdown``
06    torch.distributed                      ``distributed.env``, ``distributed.launch``,
                                             ``distributed.collectives``, ``distributed.run``
11    model and pipeline parallelism         ``distributed.pipelining`` (``split``,
                                             ``model_parallel``, ``stage``, ``schedules``,
                                             ``memory``), ``examples.pipeline_workers``
12    after training                         ``deploy`` (load anywhere, fine-tune, int8 with
                                             torchao), ``examples.deploy_workers``
====  =====================================  =================================================

Layers (checked by import-linter in ``make test``): foundations (``config``, ``devices``,
``timing``, ``data``, ``models``, ``deploy``) <- ``distributed`` <- ``parallel`` <- ``plots``
<- ``train`` <- ``bench``, ``checks``, ``examples``. A module imports only from layers below it: the
mechanisms never import the loops or the presentation.

The names listed in each module's ``__all__`` are the stable API that homework relies on.
"""
__version__ = "0.1.0"
