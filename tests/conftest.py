pytest_plugins = ["pytester", "checkout_guard"]
