"""The shared-memory data plane: tensor bytes in memory both processes map, small messages beside them.

``arena``: a memfd-backed area and the allocator its owner uses; ``tensors``: tensors packed into
a block and read back as numpy views; ``channel``: length-prefixed control messages over a
socketpair. Front-end workers and process instances use it; the shared-memory extensions are
meant to use the same pieces.
"""
