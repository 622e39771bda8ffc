"""How forwards run: the one layer that decides, per forward, between eager PyTorch, the CPU's
compiled programs and a CUDA-graph bucket, for the target (`target.TargetRunner`) and each draft
head (`head_runner.HeadRunner`), from a `plan.RuntimePlan` made once per engine. The engine and the
drafters above call the runners; the models below never ask."""
