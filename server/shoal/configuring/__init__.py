"""A model's config, from its folder to the spec the server loads: ``pipeline`` (read, complete from the
model file or the model's own code, check, normalize; what the server loads models with) and
``commands`` (``shoal config generate`` and ``check``, which run the same pipeline).

Reading and writing config.pbtxt itself, which the backends need too, sits below them in
``shoal.repository`` (``config``, ``config_text``, the ensemble and sequence parts); the tuner that
measures a served model (``shoal.tools.tune``) sits above, beside the server it drives.
"""
