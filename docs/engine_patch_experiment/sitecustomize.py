"""EXPERIMENT ONLY, not used by the package: the engine changes proposed in docs/performance.md, monkeypatched in so
their effect can be measured before anyone edits ds_terapipe/. Python imports ``sitecustomize`` at start-up, so
putting this directory on PYTHONPATH patches the benchmark's workers too; only engines whose terapipe config has
``p2p_timeout_s == 901`` are patched, so patched and unpatched engines alternate within one run:

    PYTHONPATH=docs/engine_patch_experiment TP_PATCH=nohdr,mask,qcopy,lazygrad \
      python benchmarks/pipeline_speedup.py --micro-batches 1,4 --variants stock \
      --extra-variant 'fix8/1f1b={"slices": 8, "schedule": "1f1b"}' \
      --extra-variant 'fix8/1f1b+patch={"slices": 8, "schedule": "1f1b", "p2p_timeout_s": 901}'

TP_PATCH, comma-separated:
  nohdr:    activations of slice i are sent with a header only the first time; later the receiver knows the shape
            (derived once, fixed by the plan) and posts a plain irecv (recv_like), like the gradient direction.
  mask:     cached float (additive) prefix-causal mask instead of a bool mask SDPA converts per call and layer.
  qcopy:    q copied in its (B, T, nh, hs) layout, so SDPA no longer pins the fused qkv output of the slice.
  lazygrad: KV gradient buffers allocated at the first backward, not at the first forward.
"""
import os
_FLAGS = set(filter(None, os.environ.get("TP_PATCH", "").split(",")))
if _FLAGS:
    import torch
    import torch.nn.functional as F
    from deepspeed.runtime.pipe import schedule as ds_schedule
    from ds_terapipe.runtime import attention as A, context as C, engine as E
    from ds_terapipe.runtime.p2p import as_tuple
    STATE = {"on": False}

    def _is_patched(engine):
        return getattr(getattr(engine, "terapipe", None), "p2p_timeout_s", None) == 901.0

    orig_init, orig_train = E.TokenPipelineEngine.__init__, E.TokenPipelineEngine.train_batch

    def init(self, *a, terapipe_config, **k):
        prev = STATE["on"]; STATE["on"] = terapipe_config.p2p_timeout_s == 901.0
        try:
            orig_init(self, *a, terapipe_config=terapipe_config, **k)
        finally:
            STATE["on"] = prev

    def train_batch(self, *a, **k):
        prev = STATE["on"]; STATE["on"] = _is_patched(self)
        try:
            return orig_train(self, *a, **k)
        finally:
            STATE["on"] = prev
    E.TokenPipelineEngine.__init__ = init
    E.TokenPipelineEngine.train_batch = train_batch

    _FMASKS = {}
    orig_attn = A.sliced_causal_attention

    def attn(q, k, v, *, cache_key, dropout_p=0.0, scale=None):
        if not STATE["on"]:
            return orig_attn(q, k, v, cache_key=cache_key, dropout_p=dropout_p, scale=scale)
        ctx = A.current_slice()
        if ctx is None or ctx.num_slices == 1:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p, scale=scale)
        if "qcopy" in _FLAGS:
            q = q.transpose(1, 2).contiguous().transpose(1, 2)
        bufs = ctx.state.buffers(cache_key, k, v)
        keys = A._PrefixKV.apply(k, bufs, "k", ctx.start)
        values = A._PrefixKV.apply(v, bufs, "v", ctx.start)
        if ctx.start == 0:
            return F.scaled_dot_product_attention(q, keys, values, is_causal=True, dropout_p=dropout_p, scale=scale)
        if "mask" in _FLAGS:
            key = (ctx.start, ctx.end, q.dtype, str(q.device))
            mask = _FMASKS.get(key)
            if mask is None:
                allowed = A._prefix_causal_mask(ctx.start, ctx.end, q.device)
                mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(~allowed, float("-inf"))
                _FMASKS[key] = mask
        else:
            mask = A._prefix_causal_mask(ctx.start, ctx.end, q.device)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, dropout_p=dropout_p, scale=scale)
    A.sliced_causal_attention = attn

    if "lazygrad" in _FLAGS:
        orig_kv_init, orig_bwd = C.KVBuffers.__init__, A._PrefixKV.backward

        def kv_init(self, like_k, like_v, seq_len, with_grad):
            lazy = STATE["on"] and with_grad
            orig_kv_init(self, like_k, like_v, seq_len, with_grad and not lazy)
            self._lazy_grad = lazy

        def bwd(ctx, grad):
            bufs = ctx.bufs
            if bufs.grad_k is None and getattr(bufs, "_lazy_grad", False):
                bufs.grad_k, bufs.grad_v = torch.zeros_like(bufs.k), torch.zeros_like(bufs.v)
            return orig_bwd(ctx, grad)
        C.KVBuffers.__init__ = kv_init
        A._PrefixKV.backward = staticmethod(bwd)

    if "nohdr" in _FLAGS:
        orig_send = E.TokenPipelineEngine._INSTRUCTION_MAP[ds_schedule.SendActivation]
        orig_recv = E.TokenPipelineEngine._INSTRUCTION_MAP[ds_schedule.RecvActivation]

        def send(self, buffer_id, microbatch, slice):
            if not _is_patched(self) or not torch.is_grad_enabled():
                return orig_send(self, buffer_id, microbatch, slice)
            sent = self.__dict__.setdefault("_shape_sent", set())
            outputs = as_tuple(self.pipe_buffers["outputs"][buffer_id])
            self._p2p.send(outputs, self.next_stage, f"activations of micro-batch {microbatch} slice {slice}",
                           header=slice not in sent)
            sent.add(slice)

        def recv(self, buffer_id, microbatch, slice):
            if not _is_patched(self) or not torch.is_grad_enabled():
                return orig_recv(self, buffer_id, microbatch, slice)
            known = self.__dict__.setdefault("_shape_known", {})
            what = f"activations of micro-batch {microbatch} slice {slice}"
            if slice in known:
                received = self._p2p.recv_like(known[slice], self.prev_stage, what)
            else:
                received = self._p2p.recv(self.prev_stage, what)
                known[slice] = [torch.empty_like(t) for t in received]
            for tensor in received:
                tensor.requires_grad_(tensor.is_floating_point())
            self.pipe_buffers["inputs"][buffer_id] = received[0] if len(received) == 1 else received
        E.TokenPipelineEngine._INSTRUCTION_MAP[ds_schedule.SendActivation] = send
        E.TokenPipelineEngine._INSTRUCTION_MAP[ds_schedule.RecvActivation] = recv
