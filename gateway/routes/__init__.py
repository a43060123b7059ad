"""HTTP routers of the gateway, one module per resource."""
