"""pushkv in vLLM: the ``PushKVConnector`` KV connector and the push-mode proxy.

* :mod:`.connector` -- ``PushKVConnector``, loaded by vLLM through
  ``kv_connector_module_path="pushkv.vllm.connector"`` (imports vLLM and torch).
* :mod:`.proxy` -- the OpenAI-compatible router behind ``pushkv proxy`` (aiohttp
  and the standard library only).
* :mod:`.params` -- the ``kv_transfer_params`` both speak (standard library only).

Importing this package imports neither vLLM nor torch.
"""
