"""Reading stored KV for a prompt: the layer loader, staging into (pinned) slots, the copy to the device."""
