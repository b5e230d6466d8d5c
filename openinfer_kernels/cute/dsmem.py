"""Distributed shared memory stores for CuTe DSL kernels: a plain ``st.shared::cluster`` into a
peer CTA's shared memory, which the DSL's own ``cute.arch.store`` does not take (it accepts the
generic, global and shared address spaces only). ``peer_address`` maps a local shared-memory
pointer to the same location in another CTA of the cluster (``mapa``); ``store_f32x4`` writes four
floats there. Ordering is the caller's: a cluster barrier (arrive.release / wait.acquire) makes the
stores visible to the peer.
"""
from __future__ import annotations

import cutlass
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm, nvvm, vector
from cutlass.cutlass_dsl import T, dsl_user_op

SHARED_CLUSTER = 7  # the NVPTX address space of shared::cluster (distributed shared memory)


@dsl_user_op
def peer_address(smem_ptr, rank, *, loc=None, ip=None) -> cutlass.Int32:
    """shared::cluster address of ``smem_ptr``'s location in cluster CTA ``rank`` (mapa)."""
    remote = nvvm.mapa(llvm.PointerType.get(SHARED_CLUSTER), smem_ptr.to_llvm_ptr(loc=loc, ip=ip),
                       cutlass.Int32(rank).ir_value(loc=loc, ip=ip), loc=loc, ip=ip)
    return cutlass.Int32(llvm.ptrtoint(T.i32(), remote, loc=loc, ip=ip))


@dsl_user_op
def store_f32x4(address: cutlass.Int32, values, *, loc=None, ip=None) -> None:
    """``st.shared::cluster.v4.f32``: four floats into a peer CTA's shared memory (16-byte aligned)."""
    ptr = llvm.inttoptr(llvm.PointerType.get(SHARED_CLUSTER), cutlass.Int32(address).ir_value(loc=loc, ip=ip),
                        loc=loc, ip=ip)
    vec = vector.from_elements(ir.VectorType.get([4], T.f32()),
                               [cutlass.Float32(v).ir_value(loc=loc, ip=ip) for v in values], loc=loc, ip=ip)
    llvm.store(vec, ptr, alignment=16, loc=loc, ip=ip)
