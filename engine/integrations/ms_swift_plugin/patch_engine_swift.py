"""The file for ``swift sft --external_plugins``: registers ``--callbacks patch_engine``.

ms-swift imports this file by path while it parses its arguments; importing it reads the
``PATCH_ENGINE_*`` settings (loading the patchset, so a misspelt name stops here) and registers
the callback. It sits alone in its folder because ms-swift puts the folder of each plugin
file first on ``sys.path``: next to ``engine/integrations/transformers.py`` or ``axolotl.py`` it
would shadow those packages in every later import. Print its path with ``python -m engine.integrations.ms_swift --plugin-path``; see
:mod:`engine.integrations.ms_swift`.
"""

from engine.integrations.ms_swift import register

register()
