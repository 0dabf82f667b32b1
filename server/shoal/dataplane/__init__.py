"""The shared-memory data plane: tensor bytes in memory both processes map, small messages beside them.

``arena``: a memfd-backed area and the allocator its owner uses; ``tensors``: tensors packed into
a block and read back as numpy views; ``channel``: length-prefixed control messages over a
socketpair (front-end workers and process instances use these); ``regions``: the segments clients
register through Triton's shared-memory extension.
"""
